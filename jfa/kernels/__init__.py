"""TLX kernels, one family per module. sm90 kernels run on Hopper; sm100 ones are compile-verified."""
