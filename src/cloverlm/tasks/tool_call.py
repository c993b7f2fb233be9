"""Tool calling: pick the right tool among 2-4 schemas and fill its arguments from the request.

Every argument value appears verbatim in the request, so the model learns to route and copy.
"""

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloverlm.tasks.base import Example, dumps, mean, same, spans_of
from cloverlm.tokenizer import parse_tool_call

_CITIES = (
    "Zurich",
    "Berlin",
    "Lisbon",
    "Oslo",
    "Vienna",
    "Madrid",
    "Prague",
    "Dublin",
    "Warsaw",
    "Athens",
    "Munich",
    "Lyon",
    "Geneva",
    "Milan",
    "Porto",
    "Krakow",
)
_FIRST = ("anna", "lukas", "marie", "jonas", "sofia", "elias", "lea", "noah")
_LAST = ("keller", "novak", "rossi", "moreau", "weber", "silva", "jensen", "horvat")
_TITLES = ("Team sync", "Dentist", "Budget review", "Lunch with Sam", "Yoga class", "Project kickoff")
_SUBJECTS = ("Quarterly report", "Meeting notes", "Invoice 2291", "Trip plans", "Welcome aboard")
_LABELS = ("pasta", "tea", "laundry", "stretch break", "oven")
_PHRASES = ("good morning", "where is the station", "thank you very much", "the bill please", "see you soon")


@dataclass(frozen=True)
class _Param:
    schema: dict
    sample: Callable[[random.Random], Any]


def _string(description: str, pool: tuple[str, ...]) -> _Param:
    return _Param({"type": "string", "description": description}, lambda r: r.choice(pool))


def _enum(description: str, values: tuple[str, ...]) -> _Param:
    return _Param(
        {"type": "string", "enum": list(values), "description": description}, lambda r: r.choice(values)
    )


def _integer(description: str, lo: int, hi: int) -> _Param:
    return _Param({"type": "integer", "description": description}, lambda r: r.randint(lo, hi))


def _number(description: str) -> _Param:
    # A nonzero decimal keeps the JSON number identical to the request text (2.0 would read as 2 there).
    return _Param(
        {"type": "number", "description": description},
        lambda r: float(f"{r.randint(1, 499)}.{r.randint(1, 9)}"),
    )


_DATE = _Param(
    {"type": "string", "description": "Date as YYYY-MM-DD"},
    lambda r: f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
)
_TIME = _Param(
    {"type": "string", "description": "Time as HH:MM"},
    lambda r: f"{r.randint(7, 19):02d}:{r.choice(('00', '15', '30', '45'))}",
)
_EMAIL = _Param(
    {"type": "string", "description": "Recipient email address"},
    lambda r: f"{r.choice(_FIRST)}.{r.choice(_LAST)}@example.com",
)
_CITY = _string("City name", _CITIES)
_UNITS = ("km", "mi", "kg", "lb", "m", "ft", "l", "gal")
_CURRENCIES = ("EUR", "USD", "GBP", "CHF", "SEK", "PLN")
_LANGUAGES = ("French", "German", "Italian", "Spanish", "Dutch", "Polish")


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    params: dict[str, _Param]
    requests: tuple[str, ...]  # phrasings that mention every argument

    def schema(self) -> dict:
        # Copied so callers may mutate an example's schemas without touching the pool.
        return copy.deepcopy(
            {
                "type": "function",
                "function": {
                    "name": self.name,
                    "description": self.description,
                    "parameters": {
                        "type": "object",
                        "properties": {k: p.schema for k, p in self.params.items()},
                        "required": list(self.params),
                    },
                },
            }
        )


TOOLS = (
    _Tool(
        "get_weather",
        "Weather forecast for a city on a date.",
        {"city": _CITY, "date": _DATE, "units": _enum("Temperature units", ("celsius", "fahrenheit"))},
        (
            "What will the weather be in {city} on {date}? Temperatures in {units}, please.",
            "Forecast for {city} on {date} in {units}?",
        ),
    ),
    _Tool(
        "search_flights",
        "Search flights between two cities.",
        {
            "origin": _string("Departure city", _CITIES),
            "destination": _string("Arrival city", _CITIES),
            "date": _DATE,
            "passengers": _integer("Number of passengers", 1, 6),
            "cabin": _enum("Cabin class", ("economy", "premium", "business")),
        },
        (
            "Find {cabin} flights from {origin} to {destination} on {date} for {passengers} passengers.",
            "I need to fly {origin} to {destination} on {date}, {passengers} passengers, {cabin} class.",
        ),
    ),
    _Tool(
        "create_event",
        "Add an event to the calendar.",
        {
            "title": _string("Event title", _TITLES),
            "date": _DATE,
            "time": _TIME,
            "duration_minutes": _integer("Length in minutes", 15, 180),
        },
        (
            "Put '{title}' in my calendar on {date} at {time} for {duration_minutes} minutes.",
            "Schedule {title} on {date}, {time}, lasting {duration_minutes} minutes.",
        ),
    ),
    _Tool(
        "convert_units",
        "Convert a quantity between units.",
        {
            "value": _number("Quantity to convert"),
            "from_unit": _enum("Source unit", _UNITS),
            "to_unit": _enum("Target unit", _UNITS),
        },
        ("How much is {value} {from_unit} in {to_unit}?", "Convert {value} {from_unit} to {to_unit}."),
    ),
    _Tool(
        "book_hotel",
        "Book a hotel room.",
        {
            "city": _CITY,
            "check_in": _DATE,
            "nights": _integer("Number of nights", 1, 14),
            "guests": _integer("Number of guests", 1, 4),
        },
        (
            "Book a hotel in {city} from {check_in} for {nights} nights, {guests} guests.",
            "I need a room in {city}, arriving {check_in}, {nights} nights for {guests} guests.",
        ),
    ),
    _Tool(
        "send_email",
        "Send an email.",
        {"to": _EMAIL, "subject": _string("Subject line", _SUBJECTS)},
        ("Email {to} with the subject '{subject}'.", "Send a mail to {to}, subject: {subject}."),
    ),
    _Tool(
        "get_exchange_rate",
        "Convert an amount between currencies.",
        {
            "amount": _integer("Amount to convert", 10, 5000),
            "base": _enum("Source currency", _CURRENCIES),
            "quote": _enum("Target currency", _CURRENCIES),
        },
        ("How much is {amount} {base} in {quote}?", "Convert {amount} {base} to {quote} for me."),
    ),
    _Tool(
        "set_timer",
        "Start a countdown timer.",
        {"minutes": _integer("Duration in minutes", 1, 90), "label": _string("Timer label", _LABELS)},
        ("Set a {minutes} minute timer called '{label}'.", "Timer for {label}: {minutes} minutes."),
    ),
    _Tool(
        "translate_text",
        "Translate text into another language.",
        {"text": _string("Text to translate", _PHRASES), "target_language": _enum("Language", _LANGUAGES)},
        ("Translate '{text}' into {target_language}.", "How do you say '{text}' in {target_language}?"),
    ),
)


def _text(value: Any) -> str:
    """How an argument value reads in the request, and inside the answer's JSON."""
    return value if isinstance(value, str) else dumps(value)


class ToolCall:
    name = "tool_call"

    def generate(self, seed: int) -> Example:
        rng = random.Random(seed)
        offered = rng.sample(TOOLS, rng.randint(2, 4))
        tool = rng.choice(offered)
        args = {k: p.sample(rng) for k, p in tool.params.items()}
        prompt = rng.choice(tool.requests).format_map({k: _text(v) for k, v in args.items()})
        truth = {"name": tool.name, "arguments": args}
        answer = f"<tool_call>\n{dumps(truth)}\n</tool_call>"
        return Example(
            task=self.name,
            seed=seed,
            prompt=prompt,
            answer=answer,
            truth=truth,
            value_spans=spans_of(answer, [_text(v) for v in args.values()]),
            tools=tuple(t.schema() for t in offered),
        )

    def answer_schema(self, example: Example) -> None:
        """None: the answer is a call wrapped in <tool_call> markers, not one JSON value, and which tool it
        calls is the model's choice. Its grammar is the one a server builds for `tools`:
        `Grammars.tool_calls([(name, parameters) of each tool in example.tools], single=True)`, one
        call of any offered tool, each tool's arguments under its own parameters schema. A schema of the
        called tool alone would hand the model the routing this task tests."""
        return None

    def check(self, example: Example, output: str) -> dict[str, float]:
        truth = example.truth
        call = parse_tool_call(output)
        args = call.get("arguments") if call else None
        args = args if isinstance(args, dict) else {}
        # The wrapper is how a runtime finds the call, so an unwrapped call is not exact.
        wrapped = "<tool_call>" in output and "</tool_call>" in output
        return {
            "parsed": float(call is not None),
            "name": float(call is not None and same(call.get("name"), truth["name"])),
            "arguments": mean(same(args.get(k), v) for k, v in truth["arguments"].items()),
            "exact": float(wrapped and same(call, truth)),
        }
