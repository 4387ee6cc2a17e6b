"""Who pays when loading one model unloads another that other keys use (serve/churn.py),
without a model: the rules on plain timestamps."""
from __future__ import annotations

import pytest

from swarmkv_ffi.serve.churn import Churn

pytestmark = pytest.mark.unit

WINDOW = 60.0


def test_unloading_a_model_nobody_else_used_lately_is_free():
    churn = Churn(WINDOW)
    assert churn.payer("b", {}, {"bob"}, now=100) == (True, None)
    assert churn.payer("b", {"bob": 90}, {"bob"}, now=100) == (True, None)        # bob's own model
    assert churn.payer("b", {"alice": 30}, {"bob"}, now=100) == (True, None)      # alice's, long ago


def test_a_key_displaces_once_per_window_then_is_refused():
    churn = Churn(WINDOW)
    assert churn.payer("b", {"alice": 95}, {"bob"}, now=100) == (True, "bob")
    churn.charge("bob", "a", now=100)
    assert churn.payer("b", {"alice": 130}, {"bob"}, now=140) == (False, None)
    assert churn.wait_s({"bob"}, now=140) == pytest.approx(20)
    assert churn.payer("b", {"alice": 150}, {"bob"}, now=160) == (True, "bob")   # the window has passed


def test_the_displaced_model_comes_back_free_for_its_users():
    churn = Churn(WINDOW)
    churn.charge("bob", "a", now=100)
    assert churn.payer("a", {"bob": 101}, {"alice"}, now=102) == (True, None)
    assert churn.payer("a", {"bob": 165}, {"alice"}, now=170) == (True, "alice")  # not after the window


def test_of_several_asking_keys_one_that_has_not_paid_pays_and_pays_for_the_whole_load():
    churn = Churn(WINDOW)
    churn.charge("bob", "a", now=100)
    assert churn.payer("c", {"alice": 110}, {"bob", "carol"}, now=120) == (True, "carol")
    assert churn.payer("c", {"dave": 110}, {"bob", "carol"}, now=120, paying="carol") == (True, "carol")


def test_a_window_of_zero_charges_nobody():
    churn = Churn(0.0)
    assert churn.payer("b", {"alice": 100}, {"bob"}, now=100) == (True, None)
