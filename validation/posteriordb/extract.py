"""Take the ported posteriors' data and reference summaries from a posteriordb checkout.

Reads a git directory of ``stan-dev/posteriordb`` (a bare clone will do) at its ``HEAD``:
each posterior's ``posteriors/<name>.json``, its data set ``data/data/<data>.json.zip`` and
its reference draws ``reference_posteriors/draws/draws/<name>.json.zip`` (10 chains of
1,000 NUTS draws from Stan, thinned from 10,000). It writes the data sets to ``data/`` and
the reference summaries (:func:`~validation.posteriordb.summary.summarise` of the draws)
with the commit to ``references.json``; the draws themselves are not kept.

Usage::

    python -m validation.posteriordb.extract /path/to/posteriordb/.git
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np

from validation.posteriordb.posteriors import DATA, POSTERIORS
from validation.posteriordb.summary import summarise

__all__ = ["REFERENCES", "extract", "head_commit", "load_references", "reference_draws"]

#: The reference summaries and the posteriordb commit they come from.
REFERENCES = Path(__file__).resolve().parent / "references.json"
_ROOT = "posterior_database"


def load_references() -> dict:
    """``references.json``: ``{"posteriordb_commit", "posteriors": {name: {...}}}``."""
    return json.loads(REFERENCES.read_text())


def extract(git_dir: str | Path, names: list[str]) -> dict:
    """Write ``data/`` and ``references.json`` for the posteriors ``names``.

    :param git_dir: a git directory of posteriordb.
    :param list names: posteriordb posterior names (keys of ``POSTERIORS``).
    :return: what was written to ``references.json``.
    """

    show = functools.partial(_show, git_dir)
    commit = head_commit(git_dir)
    DATA.mkdir(exist_ok=True)
    written = {}
    for name in names:
        posterior = json.loads(show(f"posteriors/{name}.json"))
        data_name = posterior["data_name"]
        if data_name != POSTERIORS[name].data_name:
            raise ValueError(f"{name}: posteriordb's data set is {data_name!r}")
        data = _unzipped(show(f"data/data/{data_name}.json.zip"))
        (DATA / f"{data_name}.json").write_text(json.dumps(data, separators=(",", ":")))
        info = json.loads(show(f"reference_posteriors/draws/info/{name}.info.json"))
        draws = reference_draws(git_dir, name)
        num_chains, num_draws = next(iter(draws.values())).shape
        written[name] = {
            "model_name": posterior["model_name"],
            "data_name": data_name,
            "num_chains": num_chains,
            "num_draws": num_draws,
            "inference": info["inference"],
            "reference": summarise(draws),
        }
        print(f"{name}: {len(draws)} parameters, {num_chains} x {num_draws} draws", flush=True)
    result = {
        "posteriordb": "https://github.com/stan-dev/posteriordb",
        "posteriordb_commit": commit,
        "posteriors": written,
    }
    REFERENCES.write_text(json.dumps(result, indent=1) + "\n")
    return result


def head_commit(git_dir: str | Path) -> str:
    """The commit at the ``HEAD`` of the posteriordb git directory ``git_dir``."""
    command = ["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def reference_draws(git_dir: str | Path, name: str) -> dict[str, np.ndarray]:
    """posteriordb's reference draws of posterior ``name`` at the ``HEAD`` of ``git_dir``:
    Stan parameter name -> draws shaped ``(chain, draw)``."""
    chains = _unzipped(_show(git_dir, f"reference_posteriors/draws/draws/{name}.json.zip"))
    return {key: np.array([chain[key] for chain in chains]) for key in chains[0]}


def _show(git_dir: str | Path, path: str) -> bytes:
    command = ["git", "--git-dir", str(git_dir), "show", f"HEAD:{_ROOT}/{path}"]
    return subprocess.run(command, check=True, capture_output=True).stdout


def _unzipped(content: bytes):
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        (member,) = archive.namelist()
        return json.loads(archive.read(member))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a git directory of stan-dev/posteriordb")
    parser.add_argument("--posteriors", nargs="*", default=sorted(POSTERIORS))
    args = parser.parse_args(argv)
    extract(args.git_dir, args.posteriors)


if __name__ == "__main__":
    main()
