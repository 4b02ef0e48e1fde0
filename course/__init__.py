"""Given infrastructure for the course: launching ranks, choosing the implementation under test,
the module catalog, the demos, generating skeletons, grading and benchmarks. Nothing in here is a
TODO: learners' code lives in steps/ (and its reference in solutions/).

The repository's paths are defined here, once."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"  # benchmark tables and demo traces (git-ignored)
