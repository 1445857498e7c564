from importlib import metadata

# The example's own tests run against the installed distribution; the repository's suite
# installs it (tests/test_example_provider.py) and then runs them. Uninstalled, skip the folder.
try:
    metadata.distribution("layer-boundary-example")
    collect_ignore = []
except metadata.PackageNotFoundError:
    collect_ignore = ["tests"]
