"""The ftrec plugin through Airflow's plugins folder: point [core] plugins_folder at this
`plugins/` folder and Airflow finds the Lighthouse tab here (the class is
ftrec_airflow.plugin.FtrecPlugin, in the package beside this file).

Airflow imports every .py file in its plugins folder as a top-level module named by its
stem; `.airflowignore` keeps it out of the package folder (its kubernetes.py would shadow
the kubernetes client). Airflow puts this folder on sys.path, so `ftrec_airflow` imports.

Where ftrec is installed, its `airflow.plugins` entry point registers the plugin, and this
file exposes nothing: Airflow registers a plugin name once and reports a second copy as a
plugin import error.
"""

from importlib import metadata

ENTRY_POINT = "ftrec_airflow.plugin:FtrecPlugin"


def entry_point_installed() -> bool:
    """Whether an installed distribution registers the plugin (Airflow loads that one)."""
    return any(ep.value == ENTRY_POINT for ep in metadata.entry_points(group="airflow.plugins"))


if not entry_point_installed():
    from ftrec_airflow.plugin import FtrecPlugin

    __all__ = ["FtrecPlugin"]
