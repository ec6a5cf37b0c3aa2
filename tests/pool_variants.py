"""Variants of a pool kind that the suites which take them also run (conftest.build_pool makes
them): "KIND+FLAG" is KIND with FLAG=True."""
VARIANTS = ["arena+single_stream", "arena_expandable+single_stream"]
