"""Host time per forward compiled vs eager vs hand-written compiled (same as `layer-boundary bench compile`)."""

from layer_boundary.bench.compile import main

if __name__ == "__main__":
    main()
