"""ssmspec: speculative decoding on state-space models and their attention hybrids."""
__version__ = "0.1.0"
