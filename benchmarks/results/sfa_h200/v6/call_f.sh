# Device call F (session 13): a register cap (ptxas maxnreg) for more resident one-warp programs, spilling, with
# programs per SM set to the resident count; CUDA tests with the probe's best and the gated decode bench. It ran
# with a temporary knob, removed after it measured slower: decode._REGISTER_CAP passed to the launch as maxnreg,
# set by a fifth field of a variant (and of best.json) in decode_probe.py and pin_config.py; they no longer read it.
VARIANTS="32/1/3/16/128 32/1/3/12/168 32/1/3/10/192 32/1/2/16/128 32/1/3/32/128 64/2/3/8/128 32/1/3/8" \
  bash benchmarks/results/sfa_h200/v6/call_c.sh
