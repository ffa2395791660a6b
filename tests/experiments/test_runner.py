"""The experiment runner reports each cell through the experiments logger, computed or read back."""

import logging

from experiments.runner import Experiment


def test_each_cell_is_reported_when_computed_and_when_read_back(tmp_path, caplog):
    experiment = Experiment(name="toy", data_dir=tmp_path, out=tmp_path / "out")
    calls = []
    with caplog.at_level(logging.INFO, logger="experiments"):
        for _ in range(2):
            experiment.cell(("sst2", "MAP", 0), lambda: calls.append(1) or {"accuracy": 0.5})
    assert calls == [1]  # the second call reads the cell back
    computed, read_back = (
        r.getMessage() for r in caplog.records if r.name.startswith("experiments")
    )
    assert computed.startswith("toy sst2 MAP 0: ") and computed.endswith(" CPU s")
    assert read_back.startswith("toy sst2 MAP 0: ") and "read back from" in read_back
