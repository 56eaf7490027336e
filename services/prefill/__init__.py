"""The prefill service: prefill, first token, pinned KV served to decode instances."""
