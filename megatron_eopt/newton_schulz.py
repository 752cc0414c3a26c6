"""The former name of :mod:`megatron_eopt.coefficients` (Newton–Schulz coefficient sets, schedules,
Muon scale factors), kept so that ``from megatron_eopt.newton_schulz import get_coefficients`` and
``importlib.import_module("megatron_eopt.newton_schulz")`` still work: both give that module itself
(the same object, so a patched attribute is seen everywhere).

Why the module moved: the package exports the *function* ``megatron_eopt.newton_schulz``, and
``import megatron_eopt.newton_schulz as ns`` looks the name up on the package first, so under this
name the module could only ever be reached as the function. A callable module (one object serving
as both) was not an option: torch.compile cannot trace a call to a module object, and
``megatron_eopt.newton_schulz(x)`` must compile with ``fullgraph=True``. Import the module as
``import megatron_eopt.coefficients as ns``.

The package's ``__init__`` imports this alias before it binds the function to the name; imported
for the first time later, the import system would set the package attribute to the module.
"""

import sys

from . import coefficients as _coefficients

sys.modules[__name__] = _coefficients
