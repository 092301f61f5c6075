"""Restoring into a slot whose MLA buffers a step grew (inside inference mode) works outside it."""

import torch

from model import load_model
from model.runner import ModelRunner


def test_restore_into_a_slot_grown_by_a_step():
    model = load_model("tiny-k3")
    runner = ModelRunner(model, 2, capacity=8)
    slot = runner.allocate()
    runner.prefill([slot], [list(range(40))])  # grows the slot's MLA buffers past capacity, in inference mode
    snap = runner.snapshot(slot)
    runner.release(slot)
    again = runner.allocate()
    assert again == slot and not torch.is_inference_mode_enabled()
    runner.restore(again, snap)  # an in-place copy into those buffers
    logits = runner.decode([again], [5])
    assert torch.isfinite(logits).all()
