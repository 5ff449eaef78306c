"""ONN (OpenNeuralEngine): a config-driven runner that trains, benchmarks and exports neural
networks of any size on the hardware you have."""

__version__ = "0.1.0"
