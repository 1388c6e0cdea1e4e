"""Small real models that run in numpy with cpuflash doing the attention (imported on demand;
``import cpuflash`` does not load them)."""
