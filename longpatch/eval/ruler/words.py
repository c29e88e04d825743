"""Offline word lists and value generators of `eval ruler` (nothing is downloaded).

RULER draws its needle keys (adjective-noun pairs) and its common-words task's words from the
`wonderwords` package's lists, and falls back to a large English word list (`english_words.json`)
when a common-words prompt needs more distinct words than those lists hold. longpatch adds no
dependency for this: the lists below are its own (plain English words written for this module), and
the large fallback is a pool of pronounceable made-up words (consonant-vowel syllables) generated
here. What the tasks ask is unchanged (find the value of a key, count repeated words); the words
are different from RULER's, so a prompt is not byte-identical to RULER's (docs/evaluation.md).
"""
from __future__ import annotations

import functools
import random
import string
import uuid

ADJECTIVES = """
able acidic afraid agile alert alive ancient angry anxious arctic ashamed awake awful bald bare basic
bitter blank bland bold bouncy brave brief bright brisk broad broken bumpy busy calm careful cheap cheerful
chilly clean clever cloudy clumsy coastal cold colossal cool cosmic cozy crazy creamy crisp crooked crowded
cruel curious curly cute damp dark dazzling deep delicate dense dizzy dry dull dusty eager early earnest
easy elastic elderly electric empty endless equal exotic faint fair fancy fast fearless fierce filthy
flat fluffy foggy fragile frantic free fresh friendly frozen funny fuzzy gentle giant gigantic glad gloomy
glossy golden graceful grand greasy great green grumpy happy hard harsh hasty heavy helpful hidden hollow
honest huge humble hungry icy idle jolly juicy keen kind large late lazy lean light little lively lonely
loud lucky lumpy mad magic massive mellow messy mighty mild misty modern moist narrow nasty neat nervous
nimble noisy odd old orange polite poor precious proud purple quick quiet rapid rare raw red rich rigid
ripe rough round royal rusty sad salty scary shaggy shallow sharp shiny short shy silent silky silly
simple sleepy slim slow small smooth soft solid sour spicy steep sticky stormy strange strict strong sturdy
sunny super sweet swift tall tame tender thick thin thirsty tidy tiny tired tough tricky ugly vast
velvet violet vivid warm wary weak weary wet whole wicked wide wild windy wise witty wooden yellow young
zany zealous
""".split()

NOUNS = """
acorn actor airport alarm album anchor angle animal ankle answer apple apron arch arena arm army arrow
artist atlas attic aunt avenue award baby badge bag bakery balcony ball balloon banana band bank barn
barrel basket bat bath beach beam bean bear beard bed bee bell belt bench berry bicycle bird biscuit blade
blanket boat bone book boot bottle box branch bread brick bridge broom brother bubble bucket building
bulb bus butter button cabin cable cactus cake camel camera camp candle canoe canyon cap captain car card
carpet carrot castle cat cave cellar chair chalk cheese cherry chess chicken chimney church circle city
cliff clock cloud coat coin comet compass cookie copper corn cottage cousin cow crab crane crayon creek
crow crown cup curtain cushion daisy dancer desert desk diamond dinner doctor dog doll dolphin door dragon
drawer dream dress drum duck eagle ear earth egg elbow engine eraser falcon farm feather fence ferry field
finger fire fish flag flame flute fog forest fork fossil fountain fox frog garden gate ghost giraffe
glacier glass glove goat gold grape grass guitar hammer harbor hat hawk heart hill hive honey horse hotel
house island jacket jar jewel jungle kettle key king kitchen kite knife ladder lake lamp lantern leaf
lemon letter library lighthouse lion lizard lock magnet mango map marble market meadow melon mirror
monkey moon mountain mouse mug museum needle nest night ocean octopus office onion orchard otter owl
painter palace panda paper parrot peach pearl pebble pen pencil pepper piano pigeon pillow pilot pine
planet plate pond potato pumpkin puzzle queen rabbit radio rain river road robot rocket roof rose sail
salad sand saddle scarf school sea seed shadow shark sheep shell ship shoe shovel silver singer sky snail
snake spider spoon squirrel stable star station stone storm stove street sugar sun swan table teacher
tent thunder tiger toast tomato tower town tractor train tree trumpet tulip turtle umbrella valley vase
violin volcano wagon wallet walnut water whale wheel window wizard wolf yacht zebra
""".split()

VERBS = """
accept add admire allow answer appear arrange arrive ask bake balance bang bathe battle beg behave belong
blink boil borrow bounce breathe brush build bump calculate call carry catch change chase cheer chew clap
climb collect comb count cover crawl cross cry dance decide deliver destroy dig divide double drag dream
drift drop dust earn enjoy enter escape explain fasten fetch fill fix float fold follow gather glow grab
greet grin guard guess hammer hang help hop hover hug hunt hurry imagine invent jog juggle jump kick
kneel knit knock laugh launch learn lift listen march melt mend mix nod notice obey open paint pause
pedal pick plant play point polish pour pray press print pull push race rain reach read relax remember
repair rescue rest return ring roll rush sail scatter scream search settle shake shiver shout sing skip
sleep slide smile sneeze sort spill spin splash squeeze stamp stare steer stir stretch swim swing talk
taste teach tickle trace travel trot tumble twist unlock vanish visit wander warn wash wave whisper whistle
wink wobble wonder wrap write yawn yell zoom
""".split()


@functools.lru_cache(maxsize=None)
def key_words() -> tuple[str, ...]:
    """Needle keys of the niah tasks: every adjective-noun pair ('tender-acorn'), sorted, as RULER builds
    its keys from its adjective and noun lists."""
    return tuple(sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS}))


@functools.lru_cache(maxsize=None)
def common_words(seed: int) -> tuple[str, ...]:
    """The common-words task's word list: nouns, adjectives and verbs, distinct and sorted, then shuffled
    with `seed` (as RULER treats its list)."""
    words = sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))
    random.Random(seed).shuffle(words)
    return tuple(words)


_ONSETS = "b d f g k l m n p r s t v z".split() + ["br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "tr"]
_VOWELS = "a e i o u".split() + ["ai", "ea", "oo"]
_ENDINGS = ["", "l", "m", "n", "r", "s", "t"]


@functools.lru_cache(maxsize=None)
def made_up_words() -> tuple[str, ...]:
    """The large fallback list (RULER: english_words.json): every two-syllable consonant-vowel word with
    an optional final consonant ('dralim'), about 258,000, distinct, in a fixed order."""
    syllables = [o + v for o in _ONSETS for v in _VOWELS]
    return tuple(dict.fromkeys(a + b + e for a in syllables for b in syllables for e in _ENDINGS))


def random_number(rng: random.Random, digits: int = 7) -> str:
    """RULER's numbers: a uniform `digits`-digit integer."""
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_uuid(rng: random.Random) -> str:
    """RULER's uuids: a version-4 UUID from 128 random bits."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value of RULER's kind: 'words' (an adjective-noun pair), 'numbers', 'uuids'."""
    if kind == "words":
        return rng.choice(key_words())
    if kind == "numbers":
        return random_number(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown needle type {kind!r}")


def random_letters(rng: random.Random, k: int, alphabet: str = string.ascii_uppercase) -> str:
    return "".join(rng.choices(alphabet, k=k))
