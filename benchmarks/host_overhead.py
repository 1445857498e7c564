"""Host overhead of the boundary vs hand-written torch (same as `layer-boundary bench host`)."""

from layer_boundary.bench.host import main

if __name__ == "__main__":
    main()
