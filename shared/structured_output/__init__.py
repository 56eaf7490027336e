"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF,
structural tags) backed by xgrammar.

`params` is torch-free (SamplingParams and the gateway import it); `backend` and `manager`
are the engine's (they import torch, and xgrammar lazily).
"""
