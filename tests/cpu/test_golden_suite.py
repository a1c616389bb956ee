"""The golden-log regression suite: every golden file in golden/ is an entry of golden/suite.json. Each entry
is run as a user runs it by the golden page's own block (`python golden/regenerate.py --reason ...`, on a copy
of golden/: tests/cpu/test_doc_journeys.py), which holds the committed file to what `rlbench golden update`
writes for that run today; `rlbench check golden` of a fresh default run against golden/default.json, exact
tier, is a usage example (test_readme_examples.py).

perf/* is left out of the CI comparison (`--ignore 'perf/*'`): timings are not asserted in tests
on this shared machine; the median comparison itself is tested in test_golden_check.py on
series whose ratio is fixed by construction.
"""

from __future__ import annotations

import json


from tests.conftest import REPO

SUITE = json.loads((REPO / "golden" / "suite.json").read_text())


def test_every_golden_file_is_in_the_suite():
    """Nothing in golden/ escapes CI: every golden file there is an entry the suite runs."""
    files = {p.stem for p in (REPO / "golden").glob("*.json") if p.name != "suite.json"}
    assert files == set(SUITE)
