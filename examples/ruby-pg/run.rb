# The job ledger from Ruby with the pg gem (ruby-pg, on libpq): the ledger's
# whole API is SQL functions, so any client that can run a query can use it.
#
#   LEDGER_DSN=postgres://user@host:5432/db ruby run.rb run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
#   ruby run.rb zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
#   ruby run.rb tokens <job> <owner> [count]            # int8 comes as a String: Integer() it
#   ruby run.rb guarded <job> <owner>                   # CALL ledger.run_guarded inside a transaction, then in autocommit
#
# Debian: ruby-pg. Without LEDGER_DSN, libpq reads PGHOST, PGPORT, PGUSER,
# PGPASSWORD, PGDATABASE. Each mode prints one JSON line saying what
# happened. `run` and `zombie` write into a table the caller created:
#   CREATE TABLE fenced_writes (token bigint, written_by text)
#
# Behind a transaction pooler (PgBouncer pool_mode=transaction) nothing needs
# setting: exec_params sends Parse, Bind and Execute of the unnamed statement
# in one round trip (libpq's PQexecParams). Do not use conn.prepare (a named
# statement lives on one server connection) nor a session SET.
require 'json'
require 'time'
require 'pg'

TABLE_INSERT = 'INSERT INTO fenced_writes (token, written_by) VALUES ($1, $2)'

# The fence's resource name. Tokens count per job, so a resource belongs to
# the first job that fenced it (another job gets LD006): one per job.
def resource_of(job) = "fenced_writes:#{job}"

# libpq runs every statement outside BEGIN in autocommit: each ledger call is
# its own transaction, committed when it returns.
def connect
  PG.connect(ENV['LEDGER_DSN'] || '', application_name: 'ledger-ruby-example')
end

# Tokens and run ids are bigint (int8). ruby-pg returns every column as a
# String by default, and Strings compare as text, which is wrong for numbers:
# "10" < "9". Convert with Integer(): a Ruby Integer is arbitrary precision,
# exact at any size (never to_f: a Float is exact only to 2^53, and tokens
# jump by 2^32 at each standby promotion). An Integer goes back as a query
# parameter as is (its decimal text). For JSON, print it as a string, as the
# other examples do. (PG::BasicTypeMapForResults does the same conversion
# for every int8 column.)
def int8(value) = value.nil? ? nil : Integer(value, 10)

# The ledger's errors are PG::Error whose result carries the fields:
# PG_DIAG_SQLSTATE (LD001..LD006 for the ledger's own, 22004 for a NULL
# argument, 22023 for an invalid one) and PG_DIAG_MESSAGE_DETAIL, a JSON
# object of facts (job, token, current_token, holder, ...). JSON.parse gives
# its numbers as Integer: exact, compare them with Integer tokens directly.
def describe(err)
  return { code: nil, message: err.message, detail: nil } unless err.is_a?(PG::Error) && err.result
  detail = err.result.error_field(PG::PG_DIAG_MESSAGE_DETAIL)
  if detail&.start_with?('{')
    begin
      detail = JSON.parse(detail)
    rescue JSON::ParserError
      # not JSON after all: keep the text
    end
  end
  { code: err.result.error_field(PG::PG_DIAG_SQLSTATE),
    message: err.result.error_field(PG::PG_DIAG_MESSAGE_PRIMARY), detail: detail }
end

# One transaction holds the fence and the application's write: they commit
# together or not at all. The fence raises LD001 when `token` is no longer the
# job's live token (it expired, or another runner took over), LD002 when a
# newer token already wrote to the resource, LD006 when the resource belongs
# to another job; then the INSERT never commits. conn.transaction sends
# BEGIN, and COMMIT at the end of the block, or ROLLBACK if it raises.
def fenced_write(conn, job, resource, token, written_by)
  conn.transaction do
    conn.exec_params('SELECT ledger.fence(job => $1, resource => $2, token => $3)', [job, resource, token])
    conn.exec_params(TABLE_INSERT, [token, written_by])
  end
end

def run_mode(job, owner, opts)
  resource = opts.fetch('resource', resource_of(job))
  ttl = Integer(opts.fetch('ttl', '30'))
  work = Integer(opts.fetch('work-ms', '0')) / 1000.0
  result = { mode: 'run', job: job, owner: owner, outcome: nil, run_id: nil, token: nil, wrote: false,
             heartbeats: 0, error: nil }
  # Two connections: the ledger's calls run in autocommit on one, the
  # application's transaction on the other. A heartbeat must never land inside
  # the application's open transaction (its lease update would stay invisible,
  # and be rolled back with it) nor queue behind a slow query.
  ledger = connect
  app = connect
  begin
    # Named notation: the contract names every argument, so a call keeps
    # working when optional arguments are added. Parameters go untyped; the
    # server reads '30 seconds' as the interval the function takes.
    start = ledger.exec_params(
      'SELECT outcome, run_id, token, holder, holder_expires_at FROM ledger.start_run(' \
      'job => $1, owner => $2, ttl => $3, idempotency_key => $4)',
      [job, owner, "#{ttl} seconds", opts['key']]
    )[0]
    result[:outcome] = start['outcome']
    case start['outcome']
    when 'started'
      nil
    when 'skipped_overlap' # another owner's lease is live: not a failure, try at the next tick
      result[:holder] = start['holder']
      # timestamptz comes as text with microseconds ("2024-06-01 02:00:00.123456+00").
      result[:holder_expires_at] = start['holder_expires_at'] &&
                                   Time.parse(start['holder_expires_at']).utc.strftime('%FT%T.%6NZ')
      return result
    when 'already_done', 'paused' # already succeeded (or running) / the job is paused: do nothing
      return result
    else
      raise "unexpected outcome #{start['outcome']}"
    end
    run_id = int8(start['run_id'])
    token = int8(start['token'])
    result[:run_id] = run_id.to_s
    result[:token] = token.to_s

    # Heartbeat every ttl/3, from a thread of its own on the ledger
    # connection: two beats may be lost before the lease expires. NULL means
    # the lease is lost (expired and taken over, or reaped): stop working,
    # nothing we write from now on would be accepted anyway. ruby-pg releases
    # Ruby's lock while it waits for the server, so the beat does not wait for
    # the work; one connection is never used by two threads at once.
    lock = Mutex.new
    wake = ConditionVariable.new
    lost = nil
    stop = false
    heart = Thread.new do
      next_beat = Process.clock_gettime(Process::CLOCK_MONOTONIC) + ttl / 3.0
      loop do
        lock.synchronize do
          while !stop && (left = next_beat - Process.clock_gettime(Process::CLOCK_MONOTONIC)).positive?
            wake.wait(lock, left)
          end
        end
        break if stop
        next_beat += ttl / 3.0
        begin
          row = ledger.exec_params('SELECT ledger.heartbeat(run_id => $1, token => $2) AS expires_at', [run_id, token])[0]
          raise 'lease lost: heartbeat returned NULL' if row['expires_at'].nil?
          result[:heartbeats] += 1
        rescue StandardError => e # LD001/LD003: the run is no longer ours
          lock.synchronize { lost = e; wake.broadcast }
          break
        end
      end
    end

    begin
      # The job's real work goes here; it stops early if the lease is lost.
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + work
      lock.synchronize do
        while lost.nil? && (left = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)).positive?
          wake.wait(lock, left)
        end
      end
      raise lost if lost

      fenced_write(app, job, resource, token, owner)
      result[:wrote] = true
    rescue StandardError => e
      result[:error] = describe(e) # any failure of the work fails the run
    ensure
      lock.synchronize { stop = true; wake.broadcast }
      heart.join # let a heartbeat in flight finish before the run ends
    end

    # End the run: this also releases the lease. A zombie learns here too that
    # it lost (LD001: a newer token took over; LD003: already closed).
    begin
      if result[:error].nil?
        ledger.exec_params('SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)', [run_id, token])
      else
        ledger.exec_params('SELECT run_id FROM ledger.fail_run(run_id => $1, token => $2, error => $3)',
                           [run_id, token, "#{result[:error][:code] || 'error'}: #{result[:error][:message]}"])
      end
    rescue PG::Error => e
      result[:end_error] = describe(e)
    end
    result
  ensure
    ledger.close
    app.close
  end
end

# A process that slept through its lease wakes up and writes with the token it
# had. The fence refuses it (LD001) and its row is rolled back; ending the run
# is refused as well.
def zombie_mode(job, owner, run_id, token)
  result = { mode: 'zombie', job: job, owner: owner, run_id: run_id, token: token, wrote: false, error: nil }
  conn = connect
  begin
    begin
      fenced_write(conn, job, resource_of(job), Integer(token, 10), owner)
      result[:wrote] = true
    rescue PG::Error => e
      result[:error] = describe(e)
    end
    begin
      conn.exec_params('SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)',
                       [Integer(run_id, 10), Integer(token, 10)])
    rescue PG::Error => e
      result[:end_error] = describe(e)
    end
    result
  ensure
    conn.close
  end
end

# Acquire the job's lease `count` times (each acquire issues a new, greater
# token) and find the newest token, once as Integer and once as the Strings
# ruby-pg returns.
def tokens_mode(job, owner, count = '10')
  conn = connect
  begin
    texts = Array.new(Integer(count)) do
      rows = conn.exec_params("SELECT token FROM ledger.acquire(job => $1, owner => $2, ttl => '1 minute')", [job, owner])
      raise "job #{job} is held by another owner" if rows.ntuples.zero?

      rows[0]['token'] # a String
    end
    tokens = texts.map { |t| int8(t) }
    newest = tokens.max # 10 > 9: right
    naive = texts.max # "9" > "10": wrong
    # Pass the Integer back as a parameter: the server compares bigints.
    current = conn.exec_params('SELECT ledger.is_current(job => $1, token => $2) AS ok', [job, newest])[0]['ok'] == 't'
    conn.exec_params('SELECT ledger.release(job => $1, owner => $2, token => $3)', [job, owner, newest])
    # And why not Float: past 2^53 it rounds, Integer stays exact.
    big = conn.exec('SELECT 9007199254740993::bigint AS b')[0]['b']
    { mode: 'tokens', job: job, owner: owner, tokens: tokens.map(&:to_s), newest: newest.to_s,
      naive_string_newest: naive, newest_was_current: current,
      beyond_2_53: { bigint: int8(big).to_s, number: Float(big).to_i.to_s } }
  ensure
    conn.close
  end
end

# ledger.run_guarded is a procedure that COMMITs: CALL it in autocommit.
# exec_params goes on the extended protocol (a portal), so inside a
# transaction the procedure cannot tell in advance and PostgreSQL refuses its
# first COMMIT with 2D000 (invalid_transaction_termination), before it did
# anything; conn.exec of a CALL without parameters goes on the simple
# protocol and is refused with 25001.
GUARDED_COMMAND = 'INSERT INTO fenced_writes (token, written_by) ' \
                  "SELECT ledger.fence(job => current_setting('ledger.job'), " \
                  "resource => 'fenced_writes:' || current_setting('ledger.job'), " \
                  "token => current_setting('ledger.token')::bigint), current_setting('ledger.owner')"

def guarded_mode(job, owner)
  call = "CALL ledger.run_guarded(job => $1, command => $2, owner => $3, ttl => '1 minute')"
  result = { mode: 'guarded', job: job, owner: owner, in_transaction: nil, autocommit: nil }
  conn = connect
  begin
    conn.exec('BEGIN')
    begin
      conn.exec_params(call, [job, GUARDED_COMMAND, owner])
    rescue PG::Error => e
      result[:in_transaction] = describe(e)
    ensure
      conn.exec('ROLLBACK')
    end
    begin
      conn.exec_params(call, [job, GUARDED_COMMAND, owner])
    rescue PG::Error => e
      result[:autocommit] = describe(e)
    end
    result
  ensure
    conn.close
  end
end

opts = {}
args = []
ARGV.each do |a|
  if (m = a.match(/\A--([a-z-]+)=(.*)\z/m))
    opts[m[1]] = m[2]
  else
    args << a
  end
end
mode, *rest = args
modes = {
  'run' => -> { run_mode(rest[0], rest[1], opts) },
  'zombie' => -> { zombie_mode(*rest.first(4)) },
  'tokens' => -> { tokens_mode(*rest.first(3)) },
  'guarded' => -> { guarded_mode(rest[0], rest[1]) }
}
if !modes.key?(mode) || rest.length < 2 || (mode == 'zombie' && rest.length < 4)
  warn "usage: ruby run.rb run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]\n" \
       "       ruby run.rb zombie <job> <owner> <run_id> <token>\n" \
       "       ruby run.rb tokens <job> <owner> [count]\n" \
       '       ruby run.rb guarded <job> <owner>'
  exit 64
end
begin
  $stdout.puts JSON.generate(modes[mode].call)
rescue StandardError => e
  warn "#{e.class}: #{e.message}\n#{e.backtrace&.join("\n")}"
  exit 1
end
