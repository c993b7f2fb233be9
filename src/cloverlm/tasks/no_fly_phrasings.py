"""The phrasings of the no_fly_zones messages, in two disjoint families.

A template is a str.format string over the fields of `no_fly_zones._fields` (id, old, fir, ad, lat,
lon, radius, unit, lower, upper, start, end, rwy, rwy_end, freq, freq2, twy). A zone template names all
nine answer fields and nothing that could be read as a second zone; every field value is a single
space-free token copied verbatim into the message.

SEEN is what the training task (no_fly_zones) writes: the five zone and ten distractor templates the
generator always had, plus more wording, abbreviations (UAS, UAV, drone, WI/within), field orders (times
or altitudes first, F) G) before E)) and look-alikes (proposed, expired, lifted or cancelled drone
restrictions; bans for helicopters only; areas where drones fly rather than may not).

UNSEEN is held out (the no_fly_zones_unseen task, never trained on). Its zones speak of RPAS, unmanned or
remotely piloted aircraft, exclusion and closed airspace; write coordinates as N47.1234 E8.1234,
47.1234N/8.1234E or "lat 47.1234 lon 8.1234"; come as ATIS broadcasts, pipe-separated bulletins and
advisories with the reference last; and its distractors (plain ones and look-alikes) are phrased the
same way, so that "a message I have never seen is the zone" is no shortcut.
"""

import re
from string import Formatter
from typing import NamedTuple


class Family(NamedTuple):
    zones: tuple[str, ...]
    distractors: tuple[str, ...]


_NOTAM = "{id} NOTAMN Q) {fir}/"  # the head every NOTAMN template shares
_BC = " A) {ad} B) {start} C) {end} E) "

SEEN = Family(
    zones=(
        # the original five
        _NOTAM + "QRTCA" + _BC + "UAS PROHIBITED WI {radius}{unit} OF {lat}N {lon}E F) {lower} G) {upper}",
        _NOTAM + "QRTCA" + _BC + "NO DRONE FLT {radius}{unit} RADIUS {lat}N {lon}E F) {lower} G) {upper}",
        "Notice {id}: drones are not allowed within {radius} {unit} of {lat}N {lon}E, from {lower} to {upper}, "
        "{start} to {end}.",
        "{id}: no UAS flights in a radius of {radius} {unit} around {lat}N {lon}E between {lower} and {upper}, "
        "valid {start} until {end}.",
        "Drone ban {id} - {radius}{unit} around {lat}N {lon}E, {lower} to {upper}, from {start} to {end}.",
        # NOTAM style
        _NOTAM + "QRTCA" + _BC + "UAV FLT PROHIBITED WI {radius}{unit} RADIUS CENTRED {lat}N {lon}E "
        "F) {lower} G) {upper}",
        _NOTAM + "QRTCA" + _BC + "TEMPO RESTRICTED AREA FOR UAS {lat}N {lon}E RADIUS {radius}{unit} "
        "F) {lower} G) {upper}",
        _NOTAM + "QRTCA A) {ad} B) {start} C) {end} F) {lower} G) {upper} E) DRONE FLIGHTS PROHIBITED WI "
        "{radius}{unit} OF {lat}N {lon}E",
        _NOTAM + "QRTCA" + _BC + "UAS ACT PROHIBITED WI CIRCLE {radius}{unit} CENTRE {lat}N {lon}E "
        "F) {lower} G) {upper}",
        "{id} UAS NO-FLY ZONE WI {radius}{unit} OF {lat}N {lon}E {lower}-{upper} FROM {start} TO {end}",
        "{id} DRONE FLT BANNED {start} TO {end} {lower}-{upper} WI {radius}{unit} OF {lat}N {lon}E",
        # plain English, several field orders
        "Notice {id}: from {start} to {end}, drones are banned within {radius} {unit} of {lat}N {lon}E between "
        "{lower} and {upper}.",
        "{id}: UAS prohibited {lower}-{upper}, radius {radius} {unit} centred on {lat}N {lon}E, {start} to {end}.",
        "Drone no-fly zone {id}: {lat}N {lon}E, radius {radius}{unit}, {lower} to {upper}, active {start} to "
        "{end}.",
        "Temporary drone ban {id} from {start} until {end}: no UAS within {radius} {unit} of {lat}N {lon}E "
        "({lower} to {upper}).",
        "Notice {id} (drones): prohibited area of {radius} {unit} around {lat}N {lon}E, {lower} up to {upper}, "
        "valid {start} to {end}.",
        "{id}: no UAV operations within {radius}{unit} of {lat}N {lon}E from {start} to {end}, {lower} to "
        "{upper}.",
        "Drone operators, notice {id}: do not fly within {radius} {unit} of {lat}N {lon}E between {lower} and "
        "{upper}, {start} to {end}.",
        "Restriction {id}: drones (UAS) are prohibited {lower} to {upper} within {radius} {unit} of {lat}N "
        "{lon}E, {start} to {end}.",
        "{id}: drone flights are not permitted within {radius} {unit} of {lat}N {lon}E from {start} to {end}, "
        "between {lower} and {upper}.",
        "Drone restriction {id} in force {start} to {end}: {radius}{unit} around {lat}N {lon}E, {lower} to "
        "{upper}.",
        "Notice {id}: {lower} to {upper} closed to drones within {radius} {unit} of {lat}N {lon}E, {start} to "
        "{end}.",
    ),
    distractors=(
        # the original ten
        _NOTAM + "QMRLC" + _BC + "RWY {rwy} CLSD DUE WIP",
        _NOTAM + "QOBCE" + _BC + "CRANE ERECTED AT {lat}N {lon}E HGT {upper} AGL, LGTD",
        _NOTAM + "QCAXX" + _BC + "TWR FREQ {freq} WITHDRAWN, USE {freq2}",
        _NOTAM + "QWPLW" + _BC + "PJE WI {radius}{unit} OF {lat}N {lon}E F) {lower} G) {upper}",
        "{id} NOTAMC {old} Q) {fir}/QRTXX A) {ad} B) {start} E) UAS RESTRICTION WI {radius}{unit} OF "
        "{lat}N {lon}E CANCELLED",
        _NOTAM + "QICAS" + _BC + "ILS RWY {rwy_end} U/S",
        "Notice {id}: increased bird activity near {lat}N {lon}E from {lower} to {upper}, {start} to {end}.",
        "Notice {id}: taxiway {twy} closed for works, {start} to {end}.",
        "Notice {id}: the drone restriction within {radius} {unit} of {lat}N {lon}E has been lifted as of "
        "{start}.",
        "{id}: glider activity within {radius} {unit} of {lat}N {lon}E, {lower} to {upper}, {start} until {end}.",
        # plain
        _NOTAM + "QLRAS" + _BC + "RWY {rwy} EDGE LGT U/S",
        "Notice {id}: apron works at {ad}, expect delays, {start} to {end}.",
        "{id}: balloon launch site {lat}N {lon}E, up to {upper}, {start} to {end}.",
        # look-alikes: not active, not for drones, or drones flying there
        "{id} NOTAMC {old} Q) {fir}/QRTXX A) {ad} B) {start} E) NO DRONE FLT {radius}{unit} RADIUS {lat}N "
        "{lon}E CANCELLED",
        "{id}: the UAS ban within {radius}{unit} of {lat}N {lon}E was lifted at {start}.",
        "Notice {id}: proposed drone no-fly zone within {radius} {unit} of {lat}N {lon}E, {lower} to {upper}, "
        "planned from {start}; not yet in force.",
        _NOTAM + "QRTXX" + _BC + "PLANNED UAS RESTRICTION WI {radius}{unit} OF {lat}N {lon}E NOT YET ACTIVE",
        "Notice {id}: the drone no-fly zone within {radius} {unit} of {lat}N {lon}E expired at {end}.",
        _NOTAM + "QRTCA" + _BC + "HEL FLT PROHIBITED WI {radius}{unit} OF {lat}N {lon}E UAS EXEMPT "
        "F) {lower} G) {upper}",
        "{id}: model aircraft flying display within {radius} {unit} of {lat}N {lon}E, {lower} to {upper}, "
        "{start} to {end}.",
        "Drone delivery corridor {id} active {start} to {end}: UAS operating within {radius} {unit} of {lat}N "
        "{lon}E, {lower} to {upper}.",
    ),
)

UNSEEN = Family(
    zones=(
        _NOTAM + "QRPCA" + _BC + "RPAS OPS NOT AUTHORIZED WI R {radius}{unit} CTR N{lat} E{lon} "
        "F) {lower} G) {upper}",
        _NOTAM + "QRRCA" + _BC + "AIRSPACE CLSD TO UNMANNED ACFT N{lat} E{lon} R={radius}{unit} "
        "F) {lower} G) {upper}",
        _NOTAM + "QRPCA A) {ad} E) REMOTELY PILOTED ACFT EXCLUDED {lower}-{upper} R{radius}{unit} N{lat} "
        "E{lon} B) {start} C) {end}",
        "ATIS {ad} INFO {id}: UNMANNED AIRCRAFT EXCLUSION {lower} TO {upper}, {radius} {unit} RADIUS OF "
        "N{lat} E{lon}, {start} TIL {end}.",
        "Bulletin {id} | RPAS exclusion zone | centre {lat}N/{lon}E | radius {radius} {unit} | levels "
        "{lower}-{upper} | {start} - {end}",
        "From {start} to {end} and between {lower} and {upper}, remotely piloted aircraft keep out of "
        "{radius} {unit} around N{lat} E{lon} (ref {id}).",
        "{id}: unmanned aircraft excluded {lower}/{upper} in a {radius} {unit} circle, centre N{lat} E{lon}, "
        "effective {start}, ends {end}.",
        "Airspace advisory {id}: UAV exclusion area N{lat} E{lon} R{radius}{unit}, vertical limits "
        "{lower}-{upper}, period {start}/{end}.",
        "{id} RPAS/UAS: NO OPS FM {start} TIL {end} BTN {lower} AND {upper}, AREA R {radius}{unit} ARND "
        "N{lat} E{lon}",
        "Safety bulletin {id}, unmanned aircraft keep out: {radius} {unit} around lat {lat} lon {lon}, "
        "{lower} to {upper}, {start} through {end}.",
    ),
    distractors=(
        # plain
        "ATIS {ad} INFO {id}: RWY {rwy} IN USE, EXPECT ILS APCH, TWR {freq}.",
        "Bulletin {id} | aerodrome {ad} | taxiway {twy} | closed for resurfacing | {start} - {end}",
        _NOTAM + "QNVAS" + _BC + "VOR/DME {ad} UNSERVICEABLE",
        "Airspace advisory {id}: parachutists over N{lat} E{lon}, R{radius}{unit}, vertical limits "
        "{lower}-{upper}, period {start}/{end}.",
        "Safety bulletin {id}, obstacle: mast at lat {lat} lon {lon}, top {upper} AGL, {start} through {end}.",
        # look-alikes
        "{id} NOTAMC {old} Q) {fir}/QRRXX A) {ad} B) {start} E) RPAS EXCLUSION R {radius}{unit} CTR N{lat} "
        "E{lon} WITHDRAWN",
        "Bulletin {id} | RPAS exclusion zone | centre {lat}N/{lon}E | radius {radius} {unit} | status: "
        "proposed, not in force",
        "Remotely piloted aircraft may again fly within {radius} {unit} of N{lat} E{lon}, exclusion rescinded "
        "{start} (ref {id}).",
        "{id}: unmanned aircraft exclusion around N{lat} E{lon} ({radius} {unit}) under consultation, "
        "planned start {start}; not yet effective.",
        "Airspace advisory {id}: helicopter exclusion N{lat} E{lon} R{radius}{unit}, {lower}-{upper}, "
        "period {start}/{end}; unmanned aircraft exempt.",
        "ATIS {ad} INFO {id}: RPAS TEST AREA ACTIVE, {radius} {unit} RADIUS OF N{lat} E{lon}, {lower} TO "
        "{upper}, MANNED TFC AVOID.",
    ),
)


def template_fields(template: str) -> set[str]:
    """The field names a template uses."""
    return {name for _, name, _, _ in Formatter().parse(template) if name}


def template_pattern(template: str) -> re.Pattern:
    """A regex that matches exactly the messages `template` writes (each field one space-free token)."""
    parts = [re.escape(text) + (r"\S+" if name else "") for text, name, _, _ in Formatter().parse(template)]
    return re.compile("".join(parts))
