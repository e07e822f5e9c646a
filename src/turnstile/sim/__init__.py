"""The simulator: event kernel, engine model, performance models, cluster driver."""
