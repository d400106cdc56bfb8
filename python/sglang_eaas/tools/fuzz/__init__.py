"""Fuzzing a live expert server over its slots and its control endpoint (docs/fuzzing.md).

``run.run_fuzz(FuzzConfig(...))`` is the whole run (``scripts/fuzz.py`` and
``test/test_fuzz.py`` call it); ``slot_cases``/``control_cases`` draw the cases and say what
each must get, ``slot_fuzzer``/``control_fuzzer`` play them, ``good_client`` is the
well-behaved client that runs meanwhile, ``checks`` the verdict.
"""
