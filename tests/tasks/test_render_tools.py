"""User-declared tools reach the prompt as the built-ins do: their schemas go to the chat template as
`tools=`, or, for a template that ignores them, into the system message that describes the tools."""

import json

from rolefleet.app.tiny_model import build_tokenizer
from rolefleet.common.config import DataSection
from rolefleet.coordinator.data import PromptDataset
from rolefleet.reward.env_tools import TOOL_SCHEMAS

TOOL = '''
def lookup(word: str, limit: int = 3) -> str:
    """Look a word up in the glossary.

    Args:
        word: the word
    """
'''
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the glossary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "description": "the word"},
                                                    "limit": {"type": "integer", "default": 3}},
                   "required": ["word"]}}}


def prompts(tmp_path, template: str) -> list[str]:
    (tmp_path / "glossary.py").write_text(TOOL)
    tokenizer = build_tokenizer(chat=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "tok")
    cfg = DataSection(task="tool_arithmetic", size=4, tools=["calculator", f"{tmp_path}/glossary.py:lookup"])
    return [r.prompt for r in PromptDataset.from_config(cfg, 0, tokenizer_path=str(tmp_path / "tok")).records]


def test_a_user_tool_schema_goes_to_the_chat_template_with_the_builtins(tmp_path):
    template = "<tools>{{ tools | tojson }}</tools>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for prompt in prompts(tmp_path, template):
        shown = json.loads(prompt[len("<tools>"):prompt.index("</tools>")])
        assert shown == [TOOL_SCHEMAS["calculator"], LOOKUP]
        assert prompt.endswith("?")


def test_a_template_that_ignores_tools_gets_the_user_tool_described_in_a_system_message(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    for prompt in prompts(tmp_path, template):
        assert prompt.startswith("<system>You can call these tools.")
        assert json.dumps(LOOKUP["function"], separators=(",", ":")) in prompt
