"""Fleet simulator (issue [14] item 1): see control/sim/api.py for the contract and docs/simulation.md."""

from control.sim.api import *  # noqa: F401,F403
from control.sim.engine import simulate  # noqa: F401
from control.sim.inputs import load_inputs  # noqa: F401
from control.sim.trace import make_trace  # noqa: F401
