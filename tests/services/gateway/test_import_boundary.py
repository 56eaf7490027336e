"""Importing the gateway app never imports torch (nor transformers until a tokenizer loads)."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_app_import_does_not_pull_torch():
    code = ("import sys, pdserve.services.gateway.app, pdserve.services.gateway.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loading_the_tokenizer_does_not_pull_torch(model_path):
    code = ("import sys; from pdserve.services.gateway.tokenization import load_tokenizer; "
            f"tok = load_tokenizer({model_path!r}); tok.apply_chat_template("
            "[{'role': 'user', 'content': 'hi'}], tokenize=False); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
