"""`picovllm plan`: size a PD fleet from measurements. profile.py measures what an engine step costs on this
machine; simulator.py replays a traffic description through colocated and xPyD deployments step by step;
plan.py ranks them by goodput under the SLOs and compares predictions with measured runs."""
