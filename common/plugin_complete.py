"""Shell completion for `kubectl instaslice`, derived from its argparse parser.

kubectl (1.26 and newer) completes a plugin's arguments by running an executable named
`kubectl_complete-<plugin>` with the words typed so far, the last one being completed, and
reading Cobra's format: one candidate per line, then `:<directive>` (4: no file names, 0: the
shell may offer files too). `completion kubectl` prints that executable (a two-line script
calling back into the plugin); `completion bash|zsh` prints a script for the
`kubectl-instaslice` command itself, built on the same answers. Candidates come from the
parser (commands, flags, choices), plus kubeconfig contexts and namespaces from kubectl.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable, Sequence

NO_FILES, FILES = 4, 0
# flag -> what kubectl lists for its value
_LOOKUPS = {
    "--context": ["config", "get-contexts", "-o", "name"],
    "--namespace": ["get", "namespaces", "-o", "name"],
}
_FILE_FLAGS = {"--kubeconfig", "--dest", "--kubectl"}

Names = Callable[[str], list[str]]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse offers no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option(parser: argparse.ArgumentParser, word: str) -> argparse.Action | None:
    for action in parser._actions:
        if word in action.option_strings:
            return action
    return None


def candidates(parser: argparse.ArgumentParser, words: Sequence[str], names: Names) -> list[str]:
    """Completions of `words[-1]` after `words[:-1]`, each ending in Cobra's directive line."""
    *done, partial = list(words) or [""]
    commands = _subparsers(parser)
    current, command, expects = parser, None, None
    for word in done:
        if expects is not None:
            expects = None
            continue
        action = _option(current, word)
        if action is not None and action.nargs != 0 and "=" not in word:
            expects = action
        elif command is None and word in commands:
            command, current = word, commands[word]
    if expects is not None:
        long = max(expects.option_strings, key=len)
        if expects.choices is not None:
            found = [str(c) for c in expects.choices]
        elif long in _LOOKUPS:
            found = [n.split("/", 1)[-1] for n in names(long)]
        else:
            return [f":{FILES if long in _FILE_FLAGS else NO_FILES}"]
    elif partial.startswith("-"):
        found = [o for a in current._actions for o in a.option_strings if o.startswith("--")]
    elif command is None:
        found = list(commands)
    else:
        positional = [a for a in current._actions if not a.option_strings and a.choices]
        found = [str(c) for a in positional for c in (a.choices or [])]
    return [*sorted({f for f in found if f.startswith(partial)}), f":{NO_FILES}"]


def kubectl_names(kubectl: str | None) -> Names:
    """Names for `_LOOKUPS` from kubectl; nothing when kubectl is missing or fails."""

    def names(flag: str) -> list[str]:
        if kubectl is None:
            return []
        try:
            proc = subprocess.run(
                [kubectl, *_LOOKUPS[flag], "--request-timeout=5s"],
                capture_output=True, text=True, check=False, timeout=10,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return []
        return proc.stdout.split() if proc.returncode == 0 else []

    return names


def completion_script(shell: str) -> str:
    if shell == "kubectl":
        return (
            "#!/bin/sh\n"
            "# kubectl_complete-instaslice: put on PATH, executable; kubectl runs it to complete\n"
            '# `kubectl instaslice ...` (kubectl 1.26+).\nexec kubectl instaslice __complete "$@"\n'
        )
    script = (
        "# kubectl-instaslice completion: source <(kubectl-instaslice completion "
        f"{shell})\n"
        "_kubectl_instaslice() {\n"
        "  local IFS=$'\\n' out\n"
        '  out=$(kubectl-instaslice __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null)\n'
        "  COMPREPLY=($(printf '%s\\n' \"$out\" | grep -v '^:'))\n"
        "  case \"$out\" in *':0') compopt -o default 2>/dev/null;; esac\n"
        "}\n"
        "complete -F _kubectl_instaslice kubectl-instaslice\n"
    )
    if shell == "zsh":
        script = "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script
