"""The replay viewer: a local web page over a run store, and the static report page."""

from experiments.viewer.server import ViewerServer, serve
from experiments.viewer.static import write_static_page

__all__ = ["ViewerServer", "serve", "write_static_page"]
