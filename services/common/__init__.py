"""Plumbing shared by the prefill and decode services: config, lifecycle, metrics, registry."""
