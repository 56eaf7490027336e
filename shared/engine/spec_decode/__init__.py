"""Speculative decoding: proposers (n-gram prompt lookup) and the engine's verification."""
