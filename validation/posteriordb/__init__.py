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
