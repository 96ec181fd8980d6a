"""The pieces every training stage shares: loop settings from a stage config, Ctrl-C handling."""

import pytest

from kvserve.train.checkpoint import saved_on_interrupt
from kvserve.train.dpo import DPOConfig
from kvserve.train.loop import LoopConfig


def test_for_stage_copies_the_stage_fields_and_caps_the_warmup():
    stage = DPOConfig(model="m", data="d", out="o", warmup_steps=8, lr=0.01, resume=True, stop_after_steps=3)
    loop = LoopConfig.for_stage(stage, 10, "dpo", min_lr_ratio=1.0)
    assert loop == LoopConfig(out="o", max_steps=10, lr=0.01, warmup_steps=5, min_lr_ratio=1.0, weight_decay=0.0,
                              grad_clip=1.0, checkpoint_every=100, resume=True, stop_after_steps=3, title="dpo")


def test_saved_on_interrupt_saves_and_closes_then_reraises():
    calls = []

    def guard():
        return saved_on_interrupt(lambda: calls.append("save"), lambda: calls.append("close"))

    with pytest.raises(KeyboardInterrupt), guard():
        raise KeyboardInterrupt
    assert calls == ["save", "close"]
    with guard():
        pass
    with pytest.raises(ValueError), guard():
        raise ValueError
    assert calls == ["save", "close"]     # only Ctrl-C saves from inside; the caller saves at the end
