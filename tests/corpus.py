"""Texts the tests share: the short licence document and its questions (one definition;
test modules import this, never each other)."""
from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LICENCE = (EXAMPLES / "apache-2.0.txt").read_text()
DOC = LICENCE[:1400]  # ~280 tokens: several n_batch=64 chunks
QUESTIONS = [
    "What is this document?",
    "Who is the Licensor?",
    "What does Contribution mean?",
    "What is a Derivative Work?",
    "Define Source form.",
    "What is Object form?",
    "Who is a Contributor?",
    "Which version of the license is this?",
]
