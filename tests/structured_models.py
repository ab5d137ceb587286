"""Pydantic models for structured-output tests, with one valid example instance each (reusable).

``CASES`` pairs each model with an example instance and a prompt that asks for such an object. The
JSON schema a client sends for a model is what the official ``openai`` client's
``client.chat.completions.parse(response_format=Model)`` puts on the wire:
:func:`response_format` (``openai.lib._parsing.type_to_response_format_param``, which calls
``openai.lib._pydantic.to_strict_json_schema``). Covered: nested objects, arrays (bounded and not),
enums (str and int), Literal, optional / nullable fields, $refs / $defs (shared and recursive), unions
(plain and discriminated), numbers with bounds and multipleOf, strings with patterns and lengths,
formats (date-time, date, uuid), tuples, free-form maps. (Not Decimal: pydantic's schema for it
allows any string, so a schema-valid answer can fail the model's own parse.)

Used by tests/unit/test_validator_structured.py (every schema is accepted and compiles, every example
matches its grammar) and by end-to-end tests that send them to the real stack.
"""

from __future__ import annotations

import datetime as dt
import uuid
from enum import Enum, IntEnum
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


class Customer(BaseModel):
    name: str
    address: Address
    vip: bool


class Todo(BaseModel):
    title: str
    done: bool


class TodoList(BaseModel):
    items: list[Todo]


class Color(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Paint(BaseModel):
    color: Color
    liters: float = Field(gt=0, le=20)


class Profile(BaseModel):
    username: str = Field(min_length=3, max_length=16)
    nickname: Optional[str] = Field(default=None, max_length=24)
    # bounded: the 135M default model at temperature 0.7 can loop inside an unbounded string until max_tokens
    website: Optional[str] = Field(default=None, max_length=40, description="homepage URL, if any")


class Measurement(BaseModel):
    value: float = Field(ge=0, le=100)
    count: int = Field(gt=0, lt=10)
    step: int = Field(multiple_of=5)


class ZipCode(BaseModel):
    code: str = Field(pattern=r"^\d{5}$")
    plus4: Optional[str] = Field(default=None, pattern=r"^\d{4}$")


class Ticket(BaseModel):
    state: Literal["open", "closed", "pending"]
    priority: Literal[1, 2, 3]


class TreeNode(BaseModel):
    label: str
    children: list["TreeNode"]


class Circle(BaseModel):
    radius: float


class Square(BaseModel):
    side: float


class Drawing(BaseModel):
    shapes: list[Union[Circle, Square]]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]


class Inventory(BaseModel):
    counts: dict[str, int]


class Shortlist(BaseModel):
    picks: list[str] = Field(min_length=1, max_length=3)


class Meeting(BaseModel):
    topic: str
    starts_at: dt.datetime
    day: dt.date
    id: uuid.UUID


class Pair(BaseModel):
    point: tuple[int, int]
    labelled: tuple[str, float]


class Employee(BaseModel):
    name: str
    home: Optional[Address]


class Department(BaseModel):
    name: str
    employees: list[Employee]


class Company(BaseModel):
    name: str
    departments: list[Department]
    founded: int = Field(ge=1800, le=2100)


class Level(IntEnum):
    LOW = 1
    MID = 2
    HIGH = 3


class Alert(BaseModel):
    level: Level
    message: str
    tags: list[Literal["infra", "app", "security"]]


class Point(BaseModel):
    x: float
    y: float


class Route(BaseModel):
    start: Point
    end: Point
    waypoints: list[Point]


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-\d{3}$")
    quantity: int = Field(ge=1)
    unit_price: float = Field(ge=0)


class Invoice(BaseModel):
    number: str
    items: list[LineItem]
    paid: bool
    note: Optional[str] = None


class Recipe(BaseModel):
    """A cooking recipe (the docstring becomes the schema's description)."""

    title: str = Field(description="the dish")
    servings: int = Field(default=2, ge=1, le=12)
    ingredients: list[str]
    steps: list[str]


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    score: float = Field(ge=-1, le=1)
    keywords: list[Annotated[str, Field(max_length=24)]] = Field(max_length=5)  # bounded: see Profile


CASES: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    (Person, {"name": "Ada", "age": 36}, "Give a person with a name and an age."),
    (Customer, {"name": "Bo", "address": {"street": "1 Main St", "city": "Oslo", "country_code": "NO"}, "vip": True},
     "Give a customer with an address."),
    (TodoList, {"items": [{"title": "milk", "done": False}, {"title": "bread", "done": True}]},
     "Give a todo list with two items."),
    (Paint, {"color": "green", "liters": 2.5}, "Pick a paint color and an amount in liters."),
    (Profile, {"username": "ada", "nickname": None, "website": "https://example.org"}, "Give a user profile."),
    (Measurement, {"value": 42.0, "count": 3, "step": 15}, "Give a measurement."),
    (ZipCode, {"code": "12345", "plus4": None}, "Give a US zip code."),
    (Ticket, {"state": "open", "priority": 2}, "Give a support ticket state and priority."),
    (TreeNode, {"label": "root", "children": [{"label": "leaf", "children": []}]}, "Give a small tree."),
    (Drawing, {"shapes": [{"radius": 1.0}, {"side": 2.0}]}, "Give a drawing with a circle and a square."),
    (Pet, {"pet": {"kind": "cat", "lives": 9}}, "Describe a pet."),
    (Inventory, {"counts": {"apples": 3, "pears": 0}}, "Give inventory counts of two fruits."),
    (Shortlist, {"picks": ["a", "b"]}, "Pick at most three names."),
    (Meeting, {"topic": "sync", "starts_at": "2026-01-02T10:00:00Z", "day": "2026-01-02",
               "id": "12345678-1234-5678-1234-567812345678"}, "Schedule a meeting."),
    (Pair, {"point": [1, 2], "labelled": ["pi", 3.14]}, "Give a point and a labelled number."),
    (Company, {"name": "Acme", "founded": 1999, "departments": [{"name": "R&D", "employees": [
        {"name": "Cy", "home": None},
        {"name": "Di", "home": {"street": "2 High St", "city": "Rome", "country_code": "IT"}}]}]},
     "Describe a company with one department."),
    (Alert, {"level": 3, "message": "disk full", "tags": ["infra"]}, "Raise an alert."),
    (Route, {"start": {"x": 0.0, "y": 0.0}, "end": {"x": 1.0, "y": 1.0}, "waypoints": [{"x": 0.5, "y": 0.5}]},
     "Give a route with one waypoint."),
    (Invoice, {"number": "INV-1", "items": [{"sku": "ABC-123", "quantity": 2, "unit_price": 9.99}], "paid": False,
               "note": None}, "Write an invoice with one line item."),
    (Recipe, {"title": "toast", "servings": 1, "ingredients": ["bread"], "steps": ["toast the bread"]},
     "Give a short recipe."),
    (Sentiment, {"label": "positive", "score": 0.8, "keywords": ["great"]},
     "Classify the sentiment of: 'What a great day!'"),
]


def response_format(model: type[BaseModel]) -> dict[str, Any]:
    """The ``response_format`` the official openai client sends for ``parse(response_format=model)``."""
    from openai.lib._parsing import type_to_response_format_param

    return dict(type_to_response_format_param(model))


def example_json(model: type[BaseModel], example: dict[str, Any], indent: int | None = None) -> str:
    """``example`` validated by ``model`` and serialized as pydantic does (compact, or indented)."""
    return model.model_validate(example).model_dump_json(indent=indent)
