"""Developer and benchmark tooling: the gradient-check gates, op and training-step benchmarks,
the GPU compile gate and the GPU-box check (`make gpu-check`)."""
