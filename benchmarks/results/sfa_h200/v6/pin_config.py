"""pytest plugin (device calls only): pins the SFA decode kernel's tile, warps, stages and programs per SM to the
JSON list in $SFA_DECODE_CONFIG, so the CUDA tests run the configuration a probe picked."""
import json, os


def pytest_configure(config):
    from sieve_attn.ops.sfa import decode
    decode._BLOCK_N, decode._NUM_WARPS, decode._NUM_STAGES, decode._PROGRAMS_PER_SM = json.load(
        open(os.environ["SFA_DECODE_CONFIG"]))[:4]
