"""turnstile: a workflow-aware scheduler for agentic LLM workloads."""

__version__ = "0.1.0"
