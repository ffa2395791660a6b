"""The validation tier itself: its fixtures load (the root conftest's too)."""

from pathlib import Path


def test_root_fixtures_reach_this_tier(float64, report):
    import torch

    assert torch.get_default_dtype() == torch.float64
    report("tier", check="root fixtures", ok=True)
    assert (Path(__file__).resolve().parents[1] / "results" / "validation" / "tier.jsonl").exists()
