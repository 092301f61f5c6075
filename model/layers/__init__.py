"""Network layers. Module attribute names follow the Hugging Face parameter names exactly."""
