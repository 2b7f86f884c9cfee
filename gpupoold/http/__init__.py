"""The HTTP listener: the JSON API, its authentication middleware and role table, the routes,
/metrics, the application keys."""
