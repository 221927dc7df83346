"""eagle-export: compile EAGLE-3 / EAGLE-3.1 drafters and their target LLMs to TensorRT engines."""

__version__ = "0.1.0"
