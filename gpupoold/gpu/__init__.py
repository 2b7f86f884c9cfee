"""The GPUs themselves: the inventory (NVML or simulated), live values, health checks, the scrub
between tenants and resets."""
