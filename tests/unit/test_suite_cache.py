"""The test suite leaves the user's cache alone."""

import os
from pathlib import Path


def test_the_suite_caches_outside_the_users_home_cache():
    cache = Path(os.environ["FEDELASTIC_CACHE"]).resolve()
    assert not cache.is_relative_to((Path.home() / ".cache").resolve()), cache
