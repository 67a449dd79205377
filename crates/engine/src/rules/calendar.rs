//! Business-hours calendars: weekly open hours in an IANA time zone, minus holiday dates.
//!
//! A calendar is defined at the top level of a rule file (`[calendar.<name>]`) and tested by the
//! `business_hours` condition. Everything is checked when the files are loaded; deciding only turns
//! the context's clock into the calendar's local date and time. Time zones, DST and zone history
//! come from jiff's bundled copy of the tz database, so they are the database's rules, not ours,
//! and the same on every machine (no `/usr/share/zoneinfo` needed).

use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::Timestamp;
use model::webhook::model::Millis;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

/// Day keys of `hours`, Monday first (the order of [`Calendar::week`]).
const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

/// `24:00`, in minutes: allowed as the end of a range, so a day can be open until midnight.
const END_OF_DAY: u16 = 24 * 60;

/// A calendar as written in a rule file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCalendar {
    time_zone: String,
    #[serde(default)]
    bots: Vec<String>,
    #[serde(default)]
    holidays: Vec<String>,
    /// Day key to `HH:MM-HH:MM` ranges; a map rather than a struct so that a wrong day key is
    /// reported with its place next to the file's other problems.
    hours: BTreeMap<String, Vec<String>>,
}

/// Open from `start` (inclusive) to `end` (exclusive), in minutes since local midnight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u16,
    end: u16,
}

impl Span {
    fn contains(self, minute: u16) -> bool {
        self.start <= minute && minute < self.end
    }
}

/// A compiled calendar.
#[derive(Debug)]
pub struct Calendar {
    time_zone: TimeZone,
    /// The bots it is for; empty is every bot.
    bots: Vec<String>,
    /// Local dates closed all day.
    holidays: BTreeSet<Date>,
    /// Open spans per day, Monday first, sorted and not overlapping.
    week: [Vec<Span>; 7],
}

impl RawCalendar {
    /// Check and compile, reporting problems as `(key path, message)` within the calendar.
    pub fn compile(&self) -> Result<Calendar, Vec<(String, String)>> {
        let mut problems = Vec::new();
        let time_zone = TimeZone::get(&self.time_zone).ok();
        if time_zone.is_none() {
            problems.push((
                "time_zone".into(),
                format!(
                    "`{}` is not a time zone of the IANA database (e.g. `Asia/Seoul`, `UTC`)",
                    self.time_zone
                ),
            ));
        }
        let mut holidays = BTreeSet::new();
        for (i, text) in self.holidays.iter().enumerate() {
            match parse_date(text) {
                Some(date) => {
                    holidays.insert(date);
                }
                None => problems.push((
                    format!("holidays[{i}]"),
                    format!("`{text}` is not a date YYYY-MM-DD"),
                )),
            }
        }
        let mut week: [Vec<Span>; 7] = Default::default();
        for (day, ranges) in &self.hours {
            let at = format!("hours.{day}");
            match DAYS.iter().position(|d| d == day) {
                Some(index) => week[index] = day_spans(ranges, &at, &mut problems),
                None => problems.push((
                    at,
                    format!("`{day}` is not a day (one of: {})", DAYS.join(", ")),
                )),
            }
        }
        match time_zone {
            Some(time_zone) if problems.is_empty() => Ok(Calendar {
                time_zone,
                bots: self.bots.clone(),
                holidays,
                week,
            }),
            _ => Err(problems),
        }
    }
}

/// One day's ranges, sorted; each bad or overlapping range is reported at its own index.
fn day_spans(ranges: &[String], at: &str, problems: &mut Vec<(String, String)>) -> Vec<Span> {
    let mut spans: Vec<(Span, usize)> = Vec::with_capacity(ranges.len());
    for (i, text) in ranges.iter().enumerate() {
        match parse_span(text) {
            Ok(span) => spans.push((span, i)),
            Err(message) => problems.push((format!("{at}[{i}]"), message)),
        }
    }
    spans.sort_by_key(|(span, _)| span.start);
    for pair in spans.windows(2) {
        let ((before, b), (after, a)) = (pair[0], pair[1]);
        if after.start < before.end {
            problems.push((
                format!("{at}[{a}]"),
                format!("`{}` overlaps `{}`", ranges[a], ranges[b]),
            ));
        }
    }
    spans.into_iter().map(|(span, _)| span).collect()
}

/// `HH:MM-HH:MM` within one day; `24:00` only as an end.
fn parse_span(text: &str) -> Result<Span, String> {
    let shape = || format!("`{text}` is not a range HH:MM-HH:MM (00:00 to 24:00)");
    let (start, end) = text.split_once('-').ok_or_else(shape)?;
    let (start, end) = (
        parse_minute(start).ok_or_else(shape)?,
        parse_minute(end).ok_or_else(shape)?,
    );
    if end <= start {
        return Err(format!(
            "`{text}` does not end after it starts; a range lies within one day (overnight: \
             split it into two days, e.g. `22:00-24:00` and `00:00-06:00` the next day)"
        ));
    }
    Ok(Span { start, end })
}

/// `HH:MM` as minutes since midnight, `00:00` to `24:00`.
fn parse_minute(text: &str) -> Option<u16> {
    let (hours, minutes) = text.split_once(':')?;
    let hours = two_digits(hours)?;
    let minutes = two_digits(minutes)?;
    let minute = hours * 60 + minutes;
    ((hours < 24 && minutes < 60) || minute == END_OF_DAY).then_some(minute)
}

fn two_digits(text: &str) -> Option<u16> {
    (text.len() == 2 && text.bytes().all(|b| b.is_ascii_digit()))
        .then(|| text.parse().ok())
        .flatten()
}

/// `YYYY-MM-DD`, a real date (no `2026-02-30`).
fn parse_date(text: &str) -> Option<Date> {
    let mut parts = text.split('-');
    let (year, month, day) = (parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    if parts.next().is_some() || !digits(year, 4) || !digits(month, 2) || !digits(day, 2) {
        return None;
    }
    Date::new(year.parse().ok()?, month.parse().ok()?, day.parse().ok()?).ok()
}

impl Calendar {
    /// Whether `bot_id` is open at `now`: the calendar is for that bot, the local date is not a
    /// holiday, and the local time lies in one of the day's ranges. A bot the calendar does not
    /// list has no business hours in it (closed), so a rule never mistakes another bot's hours
    /// for its own.
    pub fn is_open(&self, now: Millis, bot_id: Option<&str>) -> bool {
        if !self.is_for(bot_id) {
            return false;
        }
        // Out of jiff's range (years beyond ±9999): not a time anyone is open.
        let Ok(instant) = Timestamp::from_millisecond(now) else {
            return false;
        };
        let local = self.time_zone.to_datetime(instant);
        if self.holidays.contains(&local.date()) {
            return false;
        }
        // `hour` is 0..=23 and `minute` 0..=59 by jiff's invariants; `try_from` keeps it total.
        let minute = u16::try_from(i16::from(local.hour()) * 60 + i16::from(local.minute()));
        let Ok(minute) = minute else {
            return false;
        };
        self.week[day_index(local.weekday())]
            .iter()
            .any(|span| span.contains(minute))
    }

    fn is_for(&self, bot_id: Option<&str>) -> bool {
        self.bots.is_empty() || bot_id.is_some_and(|id| self.bots.iter().any(|b| b == id))
    }
}

fn day_index(day: Weekday) -> usize {
    match day {
        Weekday::Monday => 0,
        Weekday::Tuesday => 1,
        Weekday::Wednesday => 2,
        Weekday::Thursday => 3,
        Weekday::Friday => 4,
        Weekday::Saturday => 5,
        Weekday::Sunday => 6,
    }
}

/// The calendars of a rule set, by name, for conditions to refer to. A name whose definition has
/// problems stays known (as `None`), so a rule naming it is not also reported as naming an
/// unknown calendar.
#[derive(Debug, Default)]
pub struct Calendars(HashMap<String, Option<Arc<Calendar>>>);

impl Calendars {
    pub fn insert(&mut self, name: String, calendar: Option<Calendar>) {
        self.0.insert(name, calendar.map(Arc::new));
    }

    /// The calendar named `name`, or why a condition cannot use it.
    pub fn get(&self, name: &str) -> Result<Arc<Calendar>, String> {
        match self.0.get(name) {
            Some(Some(calendar)) => Ok(Arc::clone(calendar)),
            Some(None) => Err(format!(
                "calendar `{name}` has problems of its own (listed with it)"
            )),
            None => {
                let mut known: Vec<&str> = self.0.keys().map(String::as_str).collect();
                known.sort_unstable();
                Err(format!(
                    "no calendar `{name}` is defined (defined: {})",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calendar(text: &str) -> Calendar {
        let raw: RawCalendar = toml::from_str(text).expect("calendar toml");
        raw.compile().expect("calendar compiles")
    }

    /// Milliseconds of an RFC 3339 instant.
    fn at(instant: &str) -> Millis {
        let ts: Timestamp = instant.parse().expect("instant");
        ts.as_millisecond()
    }

    fn open(cal: &Calendar, instant: &str) -> bool {
        cal.is_open(at(instant), Some("bot-1"))
    }

    const SEOUL: &str = r#"
        time_zone = "Asia/Seoul"
        [hours]
        mon = ["13:00-18:00", "09:00-12:00"]
        fri = ["09:00-18:00", "20:00-24:00"]
        sat = []
    "#;

    #[test]
    fn open_inside_the_days_ranges_and_closed_between_them_and_on_days_without_hours() {
        let cal = calendar(SEOUL);
        // Seoul is UTC+9 all year. 2026-03-09 is a Monday.
        assert!(open(&cal, "2026-03-09T01:00:00Z"), "Mon 10:00");
        assert!(!open(&cal, "2026-03-09T03:30:00Z"), "Mon 12:30, lunch");
        assert!(open(&cal, "2026-03-09T05:00:00Z"), "Mon 14:00");
        assert!(!open(&cal, "2026-03-09T10:00:00Z"), "Mon 19:00");
        assert!(!open(&cal, "2026-03-10T01:00:00Z"), "Tue 10:00, no hours");
        assert!(!open(&cal, "2026-03-14T01:00:00Z"), "Sat 10:00, empty");
    }

    #[test]
    fn a_range_opens_at_its_start_and_closes_at_its_end_and_24_00_is_midnight() {
        let cal = calendar(SEOUL);
        assert!(!open(&cal, "2026-03-08T23:59:59.999Z"), "Mon 08:59:59.999");
        assert!(open(&cal, "2026-03-09T00:00:00Z"), "Mon 09:00 sharp");
        assert!(open(&cal, "2026-03-09T02:59:59.999Z"), "Mon 11:59:59.999");
        assert!(!open(&cal, "2026-03-09T03:00:00Z"), "Mon 12:00 sharp");
        assert!(open(&cal, "2026-03-09T04:00:00Z"), "Mon 13:00 sharp");
        // Friday 20:00-24:00 runs to the last millisecond of the day, and no further.
        assert!(open(&cal, "2026-03-13T14:59:59.999Z"), "Fri 23:59:59.999");
        assert!(!open(&cal, "2026-03-13T15:00:00Z"), "Sat 00:00");
        let all_day = calendar("time_zone = \"UTC\"\n[hours]\nwed = [\"00:00-24:00\"]\n");
        assert!(open(&all_day, "2026-03-11T00:00:00Z"));
        assert!(open(&all_day, "2026-03-11T23:59:59.999Z"));
        assert!(!open(&all_day, "2026-03-10T23:59:59.999Z"));
        assert!(!open(&all_day, "2026-03-12T00:00:00Z"));
    }

    #[test]
    fn a_holiday_is_closed_for_the_whole_local_date() {
        let cal = calendar(
            r#"
            time_zone = "Asia/Seoul"
            holidays = ["2026-12-25"]
            [hours]
            thu = ["00:00-24:00"]
            fri = ["00:00-24:00"]
            sat = ["00:00-24:00"]
            "#,
        );
        // 2026-12-25 is a Friday; it begins in Seoul at 15:00 UTC the day before.
        assert!(open(&cal, "2026-12-24T14:59:59.999Z"), "Thu 23:59 local");
        assert!(!open(&cal, "2026-12-24T15:00:00Z"), "Fri 00:00 local");
        assert!(!open(&cal, "2026-12-25T05:00:00Z"), "Fri 14:00 local");
        assert!(!open(&cal, "2026-12-25T14:59:59.999Z"), "Fri 23:59 local");
        assert!(open(&cal, "2026-12-25T15:00:00Z"), "Sat 00:00 local");
    }

    #[test]
    fn the_same_instant_is_inside_in_one_time_zone_and_outside_in_another() {
        let hours = "[hours]\nmon = [\"09:00-18:00\"]\ntue = [\"09:00-18:00\"]\n";
        let seoul = calendar(&format!("time_zone = \"Asia/Seoul\"\n{hours}"));
        let new_york = calendar(&format!("time_zone = \"America/New_York\"\n{hours}"));
        // Tue 10:00 in Seoul, Mon 21:00 in New York (EDT).
        assert!(open(&seoul, "2026-03-10T01:00:00Z"));
        assert!(!open(&new_york, "2026-03-10T01:00:00Z"));
        // Tue 23:00 in Seoul, Tue 10:00 in New York.
        assert!(!open(&seoul, "2026-03-10T14:00:00Z"));
        assert!(open(&new_york, "2026-03-10T14:00:00Z"));
    }

    #[test]
    fn local_hours_follow_daylight_saving_time_on_both_transitions() {
        let cal = calendar(
            r#"
            time_zone = "America/New_York"
            [hours]
            sat = ["09:00-17:00"]
            sun = ["01:00-02:00", "02:00-03:00", "09:00-17:00"]
            "#,
        );
        // 2026-03-07 (Sat) is EST (UTC-5); on Sun 2026-03-08 clocks jump 02:00 -> 03:00 EDT.
        assert!(!open(&cal, "2026-03-07T13:30:00Z"), "Sat 08:30 EST");
        assert!(open(&cal, "2026-03-07T14:00:00Z"), "Sat 09:00 EST");
        assert!(open(&cal, "2026-03-08T13:00:00Z"), "Sun 09:00 EDT");
        assert!(open(&cal, "2026-03-08T13:30:00Z"), "Sun 09:30 EDT");
        assert!(!open(&cal, "2026-03-08T12:59:59.999Z"), "Sun 08:59 EDT");
        assert!(open(&cal, "2026-03-08T06:59:59.999Z"), "Sun 01:59 EST");
        // 02:00-03:00 does not exist that night: the next instant is 03:00 EDT, closed.
        assert!(!open(&cal, "2026-03-08T07:00:00Z"), "Sun 03:00 EDT");
        // On Sun 2026-11-01 01:00-02:00 happens twice (EDT, then EST): open both times.
        assert!(!open(&cal, "2026-11-01T04:59:59.999Z"), "00:59 EDT");
        assert!(open(&cal, "2026-11-01T05:30:00Z"), "01:30 EDT");
        assert!(open(&cal, "2026-11-01T06:30:00Z"), "01:30 EST");
        assert!(open(&cal, "2026-11-01T07:00:00Z"), "02:00 EST");
        assert!(!open(&cal, "2026-11-01T08:00:00Z"), "03:00 EST");
    }

    #[test]
    fn a_calendar_with_bots_is_closed_for_every_other_bot() {
        let hours = "time_zone = \"UTC\"\n[hours]\nmon = [\"00:00-24:00\"]\n";
        let for_one = calendar(&format!("bots = [\"bot-1\"]\n{hours}"));
        let monday = at("2026-03-09T12:00:00Z");
        assert!(for_one.is_open(monday, Some("bot-1")));
        assert!(!for_one.is_open(monday, Some("bot-2")));
        assert!(!for_one.is_open(monday, None));
        let for_all = calendar(hours);
        assert!(for_all.is_open(monday, Some("bot-2")));
        assert!(for_all.is_open(monday, None));
    }

    #[test]
    fn clocks_out_of_range_are_closed_not_a_panic() {
        let cal = calendar("time_zone = \"UTC\"\n[hours]\nmon = [\"00:00-24:00\"]\n");
        assert!(!cal.is_open(Millis::MAX, None));
        assert!(!cal.is_open(Millis::MIN, None));
    }

    #[test]
    fn times_and_dates_are_parsed_strictly() {
        assert_eq!(parse_minute("00:00"), Some(0));
        assert_eq!(parse_minute("23:59"), Some(1439));
        assert_eq!(parse_minute("24:00"), Some(END_OF_DAY));
        for bad in [
            "24:01", "9:00", "09:60", "0900", "09:00:00", "+9:00", "ab:cd", "",
        ] {
            assert_eq!(parse_minute(bad), None, "{bad}");
        }
        assert!(parse_date("2028-02-29").is_some());
        for bad in [
            "2026-02-29",
            "2026-13-01",
            "26-12-25",
            "2026-12-25T00:00",
            "20261225",
        ] {
            assert_eq!(parse_date(bad), None, "{bad}");
        }
    }
}
