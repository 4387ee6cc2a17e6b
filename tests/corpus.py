"""Texts the tests share: the short licence document and its questions (one definition;
test modules import this, never each other)."""
from __future__ import annotations

from pathlib import Path

#: The repository's root (tests/ sits below it, test modules one folder further down).
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LICENCE = (EXAMPLES / "apache-2.0.txt").read_text()
APACHE = LICENCE            # (the servers' tests call it by its file's name)
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
