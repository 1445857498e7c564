import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["layer_boundary.testing.pytest_plugin"]

try:  # property-test budgets: `ci` (default, deterministic) and `dev` (a longer local run)
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile("dev", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # the core-only matrix environment has hypothesis too; keep import errors harmless
    pass
