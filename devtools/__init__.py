"""Developer and operator tooling on top of every service: the local stack (`rlgate up`), the container health
probe (`rlgate healthcheck`), the configuration reference generator and the stub generator (`make proto`).

The top layer: it may import any service's config and code; no service imports it."""
