"""posteriordb as the reference suite of the SGMCMC kernels' defaults (issue 33).

Posteriors of the public posterior database (``stan-dev/posteriordb``), each ported by
hand from its Stan program to a Pyro model (:mod:`.models`, registered in
:mod:`.posteriors`), with their data (``data/``) and a summary of posteriordb's reference
draws, 10 chains of 1,000 NUTS draws from Stan (``references.json``, written by
:mod:`.extract`). Pyro's NUTS on each port is the control (``control.json``, written by
:mod:`.control`); :mod:`.run` runs SGLD, SGHMC and SGNHT with their defaults and judges
each run against the reference; :mod:`.table` turns its output into the docs table.
See README.md beside this file.
"""

import os
import sys


def _prefer_pythonpath() -> None:
    """Let ``PYTHONPATH`` choose the pyro_bdl under test.

    ``python -m validation.posteriordb.run`` puts the working directory first on
    ``sys.path``, ahead of ``PYTHONPATH``, so from this checkout
    ``PYTHONPATH=/other/checkout:. python -m validation.posteriordb.run`` would judge this
    checkout's kernels, not the other's. Before pyro_bdl is imported, the working
    directory moves to just after ``PYTHONPATH``'s entries.
    """
    listed = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not listed or "pyro_bdl" in sys.modules or not sys.path:
        return
    if os.path.abspath(sys.path[0] or os.curdir) != os.getcwd():
        return
    working = sys.path.pop(0)
    after = [i for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) in listed]
    sys.path.insert(max(after, default=-1) + 1, working)


_prefer_pythonpath()
