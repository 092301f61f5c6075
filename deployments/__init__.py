"""The serving platform: engine, Ray Serve deployments, ingresses and the CLI."""
