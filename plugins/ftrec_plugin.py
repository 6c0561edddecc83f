"""The ftrec plugin through Airflow's plugins folder: point [core] plugins_folder at this
`plugins/` folder and Airflow finds the Lighthouse tab here (the class is
ftrec_airflow.plugin.FtrecPlugin, in the package beside this file).

The long form: docs/airflow.md, "plugins/ftrec_plugin"."""

from importlib import metadata

ENTRY_POINT = "ftrec_airflow.plugin:FtrecPlugin"


def entry_point_installed() -> bool:
    """Whether an installed distribution registers the plugin (Airflow loads that one)."""
    return any(ep.value == ENTRY_POINT for ep in metadata.entry_points(group="airflow.plugins"))


if not entry_point_installed():
    from ftrec_airflow.plugin import FtrecPlugin

    __all__ = ["FtrecPlugin"]
