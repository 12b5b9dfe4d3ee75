"""tarq-deploy: rare-word-preserving 4-bit quantization of speech recognisers and export to deployment runtimes."""

__version__ = "0.1.0"
