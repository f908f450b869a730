"""`picovllm plan`: measured step profiles (profile.py) and a simulation of colocated and xPyD fleets
(simulate.py) that recommends how many prefill and decode engines to run, and the prefill chunk size."""
