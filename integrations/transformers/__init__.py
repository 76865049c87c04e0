"""Hugging Face transformers / TRL integration: data loading for the CLI, trainer callbacks."""
